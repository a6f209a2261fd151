"""Hostile chat templates (a GGUF file's tokenizer.chat_template is code from the file): each is refused with one
TokenizerError within seconds, before its output or any value in it outgrows the render limit; on the command
line, one `error:` line and exit 2 (the server's answer: tests/server/test_hostile_bodies.py).

Each template renders in its own process under RLIMIT_AS (2 GiB) and a timeout: an allocation the bounds should
have prevented fails there at once, and a loop they should have stopped is killed."""
from __future__ import annotations

import resource
import subprocess
import sys
import time

import pytest

RENDER = """
import sys, llorch_ref
from llorch_ref.errors import TokenizerError
tok = llorch_ref.load(sys.argv[1], weights="lazy").tokenizer
tok.chat_template = sys.argv[2]
try:
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    print("rendered", len(out))
except TokenizerError as e:
    print("refused", e)
"""
MEMORY_CAP = 2 << 30


def render_apart(model, template, timeout=30):
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", RENDER, str(model), template], capture_output=True, text=True,
                       timeout=timeout, preexec_fn=cap)
    return r, time.monotonic() - t0


HOSTILE = {
    "string times 10**13": "{{ 'x' * 10**13 }}",
    "string times 10**8": "{{ 'x' * 10**8 }}",
    "list times 10**9": "{{ ['x'] * 10**9 }}",
    "content times 10**7": "{{ messages[0]['content'] * 10**7 }}",
    "power of a power": "{{ 10 ** (10 ** 10) }}",
    "output of a gigabyte": "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}",
    "nested empty loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "center filter": "{{ 'x' | center(10**10) }}",
    "ljust method": "{{ 'x'.ljust(10**10) }}",
    "percent width": "{{ '%10000000000s' % 'x' }}",
    "format width": "{{ '{:>10000000000}'.format('x') }}",
    "format filter width": "{{ '%10000000000s' | format('x') }}",
    "namespace doubling": "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s | length }}",
    "macro doubling": "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}",
    "replace expansion": "{{ ('x' * 1000) | replace('x', 'y' * 100000) }}",
    "division by zero": "{{ 1 / 0 }}",
    "raise_exception": "{{ raise_exception('this template refuses') }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_refused_in_seconds(tiny, name):
    r, dt = render_apart(tiny(vocab="bpe"), HOSTILE[name])
    assert r.stdout.startswith("refused "), (r.returncode, r.stdout, r.stderr[-2000:])
    assert "chat template" in r.stdout and dt < 15, (r.stdout, dt)


BENIGN = [
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ loop.index }}:{{ m.content | trim }}"
    "{% endfor %}{{ '-' * 20 }}{{ ns.n }}{{ '%05d' % 42 }}{{ '{:>8}'.format(bos_token) }}",
    "{{ messages | map(attribute='content') | join(' | ') | upper }}{{ (messages[0].content * 3) | replace('h', 'H') }}",
]


@pytest.mark.parametrize("template", BENIGN)
def test_benign_templates_render_as_jinja_renders_them(tiny, template):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    import llorch_ref

    tok = llorch_ref.load(tiny(vocab="bpe"), weights="lazy").tokenizer
    tok.chat_template = template
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    want = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=msgs, add_generation_prompt=True, bos_token=tok.tokens[tok.bos_id], eos_token=tok.tokens[tok.eos_id])
    assert tok.apply_chat_template(msgs) == want


def test_a_long_conversation_fits_the_render_limit(tiny):
    import llorch_ref

    tok = llorch_ref.load(tiny(vocab="bpe"), weights="lazy").tokenizer
    msgs = [{"role": "user", "content": "w" * (3 << 20)}]
    assert len(tok.apply_chat_template(msgs)) > 3 << 20


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    """The tiny model with the first hostile template in its file."""
    from llorch_ref.testing import tiny as tiny_mod

    saved = tiny_mod.CHAT_TEMPLATE
    tiny_mod.CHAT_TEMPLATE = HOSTILE["string times 10**13"]
    try:
        return tiny_mod.write_tiny_model(tmp_path_factory.mktemp("hostile") / "t.gguf", vocab="bpe")
    finally:
        tiny_mod.CHAT_TEMPLATE = saved


def test_generate_chat_with_a_hostile_template_is_one_error_line(hostile_model):
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "generate", "hi", "--chat", "--max-tokens", "1",
                        "--model", str(hostile_model)], capture_output=True, text=True, timeout=60, preexec_fn=cap)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "chat template" in lines[0]
