"""Recurrent ops: LSTM, GRU, RNN (ONNX semantics; torch's exporter emits LSTM and GRU).

The common configuration (default activations, no clip, peepholes or sequence_lens, and
GRU's linear_before_reset=1) runs torch's fused kernel (`torch.lstm` / `torch.gru` /
`torch.rnn_tanh`), exactly what `nn.LSTM` / `nn.GRU` / `nn.RNN` run: only the gate order
differs between ONNX and torch. Anything else runs a step loop that implements the spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metaopt.ops.registry import register

# Activation name -> (function of (x, alpha, beta), default alpha, default beta).
_ACTS = {
    "Sigmoid": (lambda x, a, b: torch.sigmoid(x), None, None),
    "Tanh": (lambda x, a, b: torch.tanh(x), None, None),
    "Relu": (lambda x, a, b: torch.relu(x), None, None),
    "LeakyRelu": (lambda x, a, b: F.leaky_relu(x, a), 0.01, None),
    "ThresholdedRelu": (lambda x, a, b: torch.where(x > a, x, 0.0), 1.0, None),
    "ScaledTanh": (lambda x, a, b: a * torch.tanh(b * x), 1.0, 1.0),
    "HardSigmoid": (lambda x, a, b: torch.clamp(a * x + b, 0.0, 1.0), 0.2, 0.5),
    "Elu": (lambda x, a, b: F.elu(x, a), 1.0, None),
    "Softsign": (lambda x, a, b: F.softsign(x), None, None),
    "Softplus": (lambda x, a, b: F.softplus(x), None, None),
    "Affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
}


def _activations(names, alphas, betas, per_dir: int, defaults: list[str], num_dir: int):
    """Per direction, the activation callables; alpha/beta lists feed the ones that use them."""
    names = names or defaults * num_dir
    alphas, betas = list(alphas or []), list(betas or [])
    out = []
    for name in names:
        fn, a, b = _ACTS[name]
        if a is not None and alphas:
            a = alphas.pop(0)
        if b is not None and betas:
            b = betas.pop(0)
        out.append(lambda x, fn=fn, a=a, b=b: fn(x, a, b))
    return [out[d * per_dir : (d + 1) * per_dir] for d in range(num_dir)]


def _is_default(names, defaults: list[str], num_dir: int) -> bool:
    return not names or list(names) == defaults * num_dir


def _reverse(x: torch.Tensor, lens: torch.Tensor | None) -> torch.Tensor:
    """Reverse in time (dim 0); with `lens`, only each sequence's valid prefix."""
    if lens is None:
        return x.flip(0)
    t = torch.arange(x.shape[0], device=x.device).reshape(-1, 1)
    src = torch.where(t < lens, lens - 1 - t, t)  # (seq, batch)
    return torch.gather(x, 0, src.reshape(*src.shape, *([1] * (x.dim() - 2))).expand(x.shape))


def _clip(x: torch.Tensor, clip: float | None) -> torch.Tensor:
    return x if clip is None else torch.clamp(x, -clip, clip)


def _run_directions(step_dir, X, direction: str, lens, num_dir: int):
    """Run `step_dir(d, x)` per direction; returns Y (seq, dir, batch, h) and final states."""
    ys, finals = [], []
    for d in range(num_dir):
        backward = direction == "reverse" or d == 1
        x = _reverse(X, lens) if backward else X
        y, final = step_dir(d, x)
        ys.append(_reverse(y, lens) if backward else y)
        finals.append(final)
    return torch.stack(ys, 1), [torch.stack(f, 0) for f in zip(*finals)]


def _loop(cell, x, states, lens):
    """Apply `cell(x_t, *states) -> (y_t, *states)` over time; frozen past each sequence's end."""
    ys = []
    for t in range(x.shape[0]):
        new = cell(x[t], *states)
        if lens is None:
            states = new
            ys.append(new[0])
        else:
            valid = (t < lens).reshape(-1, 1)
            states = tuple(torch.where(valid, n, s) for n, s in zip(new, states))
            ys.append(torch.where(valid, new[0], 0.0))
    return torch.stack(ys, 0), states


def _prepare(X, layout: int, sequence_lens, initial: list, num_dir: int, hidden: int):
    if layout:  # batch-major -> sequence-major
        X = X.transpose(0, 1)
        initial = [s.transpose(0, 1) if s is not None else None for s in initial]
    batch = X.shape[1]
    lens = None
    if sequence_lens is not None:
        lens = sequence_lens.to(device=X.device, dtype=torch.int64)
        if bool((lens == X.shape[0]).all()):
            lens = None  # full-length sequences: no masking needed
    zero = torch.zeros(num_dir, batch, hidden, dtype=X.dtype, device=X.device)
    initial = [s if s is not None else zero for s in initial]
    return X, lens, initial


def _finish(Y, finals, layout: int, nout: int):
    if layout:
        Y = Y.permute(2, 0, 1, 3)
        finals = [f.transpose(0, 1) for f in finals]
    outs = (Y, *finals)
    return outs[:nout] if nout > 1 else Y


def _full_length(X: torch.Tensor, layout: int, sequence_lens: torch.Tensor | None) -> bool:
    return sequence_lens is None or bool((sequence_lens == X.shape[1 if layout else 0]).all())


def _fused(fn, X, initial: list, W, R, B, order, gates: int, direction: str, layout: int, nout: int):
    """torch's fused kernel, called as the torch module would (batch_first for layout=1)."""
    num_dir, hidden = W.shape[0], R.shape[-1]
    time = 1 if layout else 0
    batch, seq = X.shape[1 - time], X.shape[time]
    zero = None
    states = []
    for s in initial:
        if s is None:
            zero = (
                zero
                if zero is not None
                else torch.zeros(num_dir, batch, hidden, dtype=X.dtype, device=X.device)
            )
            s = zero
        elif layout:
            s = s.transpose(0, 1)  # ONNX layout=1 states are batch-major, torch's never are
        states.append(s)
    hx = tuple(states) if len(states) > 1 else states[0]
    weights = _fused_weights(W, R, B, order, gates, num_dir, hidden)
    reverse = direction == "reverse"  # torch has no reverse-only RNN: run forward on flipped time
    x = X.flip(time) if reverse else X
    y, *finals = fn(x, hx, weights, B is not None, 1, 0.0, False, num_dir == 2, bool(layout))
    if reverse:
        y = y.flip(time)
    if layout:
        Y = y.reshape(batch, seq, num_dir, hidden)
        finals = [f.transpose(0, 1) for f in finals]
    else:
        Y = y.reshape(seq, batch, num_dir, hidden).transpose(1, 2)
    outs = (Y, *finals)
    return outs[:nout] if nout > 1 else Y


def _torch_gates(w: torch.Tensor, order: tuple[int, ...], n: int) -> torch.Tensor:
    chunks = w.chunk(n, 0)
    return torch.cat([chunks[i] for i in order], 0)


# ONNX gate order -> torch's: LSTM i,o,f,c -> i,f,c,o ; GRU z,r,h -> r,z,h.
_LSTM_ORDER = (0, 2, 3, 1)
_GRU_ORDER = (1, 0, 2)
_FUSED_RNN = {"Tanh": torch.rnn_tanh, "Relu": torch.rnn_relu}


def _fused_weights(W, R, B, order, n: int, num_dir: int, hidden: int) -> list[torch.Tensor]:
    weights = []
    for d in range(num_dir):
        weights += [_torch_gates(W[d], order, n), _torch_gates(R[d], order, n)]
        if B is not None:
            wb, rb = B[d].split(n * hidden)
            weights += [_torch_gates(wb, order, n), _torch_gates(rb, order, n)]
    return weights


@register("LSTM", needs_outputs=True, host_inputs=(4,))
def lstm(
    X: torch.Tensor,
    W: torch.Tensor,
    R: torch.Tensor,
    B: torch.Tensor | None = None,
    sequence_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
    initial_c: torch.Tensor | None = None,
    P: torch.Tensor | None = None,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    layout: int = 0,
    _nout: int = 1,
):
    num_dir, hidden = W.shape[0], R.shape[-1]
    defaults = ["Sigmoid", "Tanh", "Tanh"]
    if (
        P is None
        and clip is None
        and not input_forget
        and _is_default(activations, defaults, num_dir)
        and _full_length(X, layout, sequence_lens)
    ):
        return _fused(
            torch.lstm, X, [initial_h, initial_c], W, R, B, _LSTM_ORDER, 4, direction, layout, _nout
        )
    X, lens, (h0, c0) = _prepare(X, layout, sequence_lens, [initial_h, initial_c], num_dir, hidden)
    acts = _activations(activations, activation_alpha, activation_beta, 3, defaults, num_dir)

    def run(d: int, x: torch.Tensor):
        f, g, h = acts[d]
        bias = B[d].reshape(2, -1).sum(0) if B is not None else 0.0
        xw = torch.matmul(x, W[d].t()) + bias
        pi, po, pf = P[d].chunk(3) if P is not None else (0.0, 0.0, 0.0)

        def cell(xw_t, h_t, c_t):
            i, o, fg, c = (xw_t + torch.matmul(h_t, R[d].t())).chunk(4, -1)
            i = f(_clip(i + pi * c_t, clip))
            fg = 1 - i if input_forget else f(_clip(fg + pf * c_t, clip))
            c_new = fg * c_t + i * g(_clip(c, clip))
            o = f(_clip(o + po * c_new, clip))
            h_new = o * h(c_new)
            return h_new, c_new

        return _loop(cell, xw, (h0[d], c0[d]), lens)

    Y, finals = _run_directions(run, X, direction, lens, num_dir)
    return _finish(Y, finals, layout, _nout)


@register("GRU", needs_outputs=True, host_inputs=(4,))
def gru(
    X: torch.Tensor,
    W: torch.Tensor,
    R: torch.Tensor,
    B: torch.Tensor | None = None,
    sequence_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    linear_before_reset: int = 0,
    _nout: int = 1,
):
    num_dir, hidden = W.shape[0], R.shape[-1]
    defaults = ["Sigmoid", "Tanh"]
    if (
        clip is None
        and linear_before_reset
        and _is_default(activations, defaults, num_dir)
        and _full_length(X, layout, sequence_lens)
    ):
        return _fused(torch.gru, X, [initial_h], W, R, B, _GRU_ORDER, 3, direction, layout, _nout)
    X, lens, (h0,) = _prepare(X, layout, sequence_lens, [initial_h], num_dir, hidden)
    acts = _activations(activations, activation_alpha, activation_beta, 2, defaults, num_dir)

    def run(d: int, x: torch.Tensor):
        f, g = acts[d]
        wb, rb = (
            B[d].chunk(2) if B is not None else (0.0, torch.zeros(3 * hidden, dtype=X.dtype, device=X.device))
        )
        xw = torch.matmul(x, W[d].t()) + wb
        r_zr, r_h = R[d][: 2 * hidden], R[d][2 * hidden :]
        rb_zr, rb_h = rb[: 2 * hidden], rb[2 * hidden :]

        def cell(xw_t, h_t):
            x_zr, x_h = xw_t[:, : 2 * hidden], xw_t[:, 2 * hidden :]
            z, r = f(_clip(x_zr + torch.matmul(h_t, r_zr.t()) + rb_zr, clip)).chunk(2, -1)
            if linear_before_reset:
                cand = x_h + r * (torch.matmul(h_t, r_h.t()) + rb_h)
            else:
                cand = x_h + torch.matmul(r * h_t, r_h.t()) + rb_h
            cand = g(_clip(cand, clip))
            return ((1 - z) * cand + z * h_t,)

        return _loop(cell, xw, (h0[d],), lens)

    Y, finals = _run_directions(run, X, direction, lens, num_dir)
    return _finish(Y, finals, layout, _nout)


@register("RNN", needs_outputs=True, host_inputs=(4,))
def rnn(
    X: torch.Tensor,
    W: torch.Tensor,
    R: torch.Tensor,
    B: torch.Tensor | None = None,
    sequence_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    _nout: int = 1,
):
    num_dir, hidden = W.shape[0], R.shape[-1]
    names = activations or ["Tanh"] * num_dir
    if (
        clip is None
        and len(set(names)) == 1
        and names[0] in _FUSED_RNN
        and _full_length(X, layout, sequence_lens)
    ):
        return _fused(_FUSED_RNN[names[0]], X, [initial_h], W, R, B, (0,), 1, direction, layout, _nout)
    X, lens, (h0,) = _prepare(X, layout, sequence_lens, [initial_h], num_dir, hidden)
    acts = _activations(activations, activation_alpha, activation_beta, 1, ["Tanh"], num_dir)

    def run(d: int, x: torch.Tensor):
        (f,) = acts[d]
        bias = B[d].reshape(2, -1).sum(0) if B is not None else 0.0
        xw = torch.matmul(x, W[d].t()) + bias

        def cell(xw_t, h_t):
            return (f(_clip(xw_t + torch.matmul(h_t, R[d].t()), clip)),)

        return _loop(cell, xw, (h0[d],), lens)

    Y, finals = _run_directions(run, X, direction, lens, num_dir)
    return _finish(Y, finals, layout, _nout)
