"""Clients of the engine inside inference stacks, one subpackage each, each an optional extra.

- `tierkv.integrations.transformers`: prefix KV reuse for Hugging Face transformers models
  (``pip install tierkv[transformers]``). See docs/integrations.md.

Importing this package imports no inference library; each subpackage imports its own.
"""

__all__: list[str] = []
