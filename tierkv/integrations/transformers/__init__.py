"""Prefix KV reuse for Hugging Face transformers models (``pip install tierkv[transformers]``).

`PrefixCache` stores a model's KV cache in a tierkv engine block by block, under chained
`tierkv.block_keys`, and loads the longest cached prefix of a later prompt as a `DynamicCache`
the model runs on; `forward_kwargs` and `output_cache` name the cache argument and output the
way the installed transformers version does. See docs/integrations.md.
"""

from tierkv.integrations.transformers._hf import forward_kwargs, output_cache
from tierkv.integrations.transformers._layout import BlockLayout
from tierkv.integrations.transformers._prefix import PrefixCache

__all__ = ["BlockLayout", "PrefixCache", "forward_kwargs", "output_cache"]
