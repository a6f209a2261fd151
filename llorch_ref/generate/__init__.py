"""Generation: token selection (sampling) as small pure functions."""
