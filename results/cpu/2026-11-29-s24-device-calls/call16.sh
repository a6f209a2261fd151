. .dev/setup.sh > /tmp/setup.log 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:$PYTHONPATH
python3 -m pytest -q -p no:cacheprovider tests/test_ggml_numerics.py -k "not default_model and not k_quant_copies" -rE 2>&1 | grep -E "^ERROR|Error|error" | head -20
