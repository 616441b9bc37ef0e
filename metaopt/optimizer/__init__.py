"""metaopt.optimizer: Fleet-style optimizers (torch.optim semantics), lr schedules, gradient clipping.

    opt = metaopt.optimizer.AdamW(learning_rate=lr.LinearWarmupDecay(1e-4, 100, 1000),
                                  grad_clip=metaopt.optimizer.ClipGradByGlobalNorm(1.0))
    optimize_ops, params_grads = opt.minimize(program.loss)   # rewrites the program in place

The ops they append are made by `metaopt.passes.optimize.apply_optimizer`.
"""

from metaopt.optimizer import lr
from metaopt.optimizer.clip import ClipGradByGlobalNorm
from metaopt.optimizer.optimizers import SGD, Adam, AdamW, Momentum, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "ClipGradByGlobalNorm", "Momentum", "Optimizer", "lr"]
