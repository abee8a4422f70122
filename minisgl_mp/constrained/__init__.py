"""Constrained decoding: a grammar (JSON schema, regex, EBNF) masks the tokens a request may
sample. `base.py` is the backend interface and the compiled-grammar cache; one backend per file;
`reasoning.py` starts a reasoning model's grammar after its thinking."""

from minisgl_mp.constrained.base import (
    GRAMMAR_BACKENDS, GrammarBackend, GrammarKey, GrammarMatcher, create_grammar_backend, grammar_key,
    request_matcher,
)

__all__ = ["GRAMMAR_BACKENDS", "GrammarBackend", "GrammarKey", "GrammarMatcher", "create_grammar_backend",
           "grammar_key", "request_matcher"]
