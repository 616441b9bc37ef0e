"""Torch kernels for the op table: importing this package registers every row.

One module per family; each registers its ops at import with `@register`.
"""

from metaopt.ops.kernels import (  # noqa: F401
    activation,
    amp,
    attention,
    comm,
    context_parallel,
    elementwise,
    expert_parallel,
    grad,
    indexing,
    layerwise,
    loss,
    memcpy,
    moe,
    nn,
    norm,
    optim,
    partition,
    random,
    reduce,
    resize,
    rng,
    rnn,
    rotary,
    segment_parallel,
    sequence_parallel,
    tensor,
    tensor_parallel,
    vision,
    vocab_parallel,
    zero,
)
