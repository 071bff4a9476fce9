"""The core: `attention()` and what it dispatches to.

attention.py   the entry points `attention` and `attention_weights`
validate.py    argument checks shared by every engine
backends/      the registry and the engines (reference, sdpa, flex, flash, triton)
kernels/       the tiled flash engine, its block plan, paged attention, the lse merge
masks/         patterns: what may attend, and the one causal rule
scores.py      score functions applied inside the engines (ALiBi, softcap, ...)
cluster.py     content-based (clustered) sparse attention
checks.py      small argument checkers
tracing.py     what the engines tell torch.compile, without importing torch._dynamo
"""
