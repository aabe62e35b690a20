"""
What carries the copy (a pre-registered measure, results/preregistered.md): in each SA+SWA model trained on the copy
task, is a copied-half query whose source lies in its own SA window ("direct") the one that copies, or do the others
copy too? far_copy.py measures each model (measure) and writes the split into lm1024.json's copy_paths; the reading,
the plot and the table come from those rows.
"""
import os

import common

USED_GATE = 0.1  # a layer is used by SA if its mean SA gate on copied-half queries is at least this (ours)


def sources_in_window(perms, window, T):
    """(..., T/2) bool for perms (..., T): whether each copied-half query's source, the key T/2 - 1 back that holds
    the byte it predicts, lies in the query's SA window (the rank rule: slots fewer than `window` apart)."""
    import torch
    slot = torch.argsort(perms, dim=-1)                                        # (..., T): each token's slot
    t = torch.arange(T // 2 - 1, T - 1)                                        # the copied half's queries
    return (slot[..., t] - slot[..., t + 1 - T // 2]).abs() < window


def measure(model, x, y, draws=8):
    """What carries the copy in an SA+SWA copy model, on the copy sequences
    x, y (n, T) at `draws` fixed draws (seed_sa(0..draws-1)): each copied-half query is DIRECT where its source
    is in its SA window in some layer and head, else OTHER; their losses, the same per layer, the masks'
    prediction for random permutations, and the per-layer SA and SWA gates; and the pre-registered reading."""
    import torch
    import torch.nn.functional as F
    from model import sa_draw
    c, (n, T) = model.config, x.shape
    L, heads, half = c.n_layer, c.n_head if c.sa_draw == "head" else 1, slice(T // 2 - 1, T - 1)
    gates = []
    hooks = [b.attn.gate.register_forward_hook(lambda m, i, o: gates.append(torch.sigmoid(o[:, half].float())))
             for b in model.transformer.h]                                     # (n, T/2, 2 * nh) per layer
    loss, first, inside, g = [], [], [], []
    with torch.no_grad():
        for d in range(draws):
            model.seed_sa(d)
            shape = [T] if c.sa_draw == "layer" else [n, c.n_head, T]           # each layer's draw, as GPT.forward's
            perms = [sa_draw(model.sa_state, shape, c.sa_rule == "value", x.device) for _ in range(L)]
            gates.clear()
            nll = F.cross_entropy(model(x, draws=perms)[0].transpose(1, 2), y, reduction="none")  # (n, T)
            loss.append(nll[:, half])
            first.append(nll[:, :T // 2 - 1].mean())
            inside.append(torch.stack([sources_in_window(p.expand(n, heads, T), c.window, T).any(1)
                                       for p in perms], 1))                   # (n, L, T/2): in layer l's window
            g.append(torch.stack(gates, 1).unflatten(-1, (2, c.n_head)).mean(-1))  # (n, L, T/2, 2): sa, swa
    for h in hooks:
        h.remove()
    loss, inside, g = torch.stack(loss), torch.stack(inside), torch.stack(g)   # (D, n, T/2), (D, n, L, T/2), ...
    direct = inside.any(2)                                                     # (D, n, T/2)
    perms = torch.rand(64, L * heads, T, generator=torch.Generator().manual_seed(0)).argsort(-1)  # random ones
    predicted = sources_in_window(perms, c.window, T).view(64, L, heads, -1).any(2)  # (64, L, T/2)
    mean = lambda t, m: float(t[m].mean()) if m.any() else None  # noqa: E731
    L1, L2 = float(torch.stack(first).mean()), float(loss.mean())
    out = dict(draws=draws, sequences=n, first=L1, second=L2, direct=float(direct.float().mean()),
               direct_predicted=float(predicted.any(1).float().mean()), loss_direct=mean(loss, direct),
               loss_other=mean(loss, ~direct),
               layers=[dict(inside=float(inside[:, :, l].float().mean()),
                            predicted=float(predicted[:, l].float().mean()),
                            loss_inside=mean(loss, inside[:, :, l]), loss_outside=mean(loss, ~inside[:, :, l]),
                            gate_sa=float(g[:, :, l, :, 0].mean()), gate_swa=float(g[:, :, l, :, 1].mean()),
                            gate_sa_inside=mean(g[:, :, l, :, 0], inside[:, :, l]),
                            gate_sa_outside=mean(g[:, :, l, :, 0], ~inside[:, :, l])) for l in range(L)])
    out["reading"] = path_reading(L1, L2, out["loss_direct"], out["loss_other"])
    used = [l for l in range(L) if out["layers"][l]["gate_sa"] >= USED_GATE]    # the layers the model uses
    direct_used = inside[:, :, used].any(2)                                    # (D, n, T/2)
    out.update(used_layers=[l + 1 for l in used], loss_direct_used=mean(loss, direct_used),
               loss_other_used=mean(loss, ~direct_used))
    return out


def path_reading(L1, L2, loss_direct, loss_other):
    """The pre-registered reading of a direct/other split: G(part) = first half - the part's copied-half loss."""
    gain = lambda part: L1 - part if part is not None else 0.0  # noqa: E731
    if L1 - L2 < 0.1:
        return "does not copy"
    if gain(loss_other) <= 0.1 * gain(loss_direct):
        return "the shortcuts carry it directly"
    return "relays carry it too" if gain(loss_other) >= 0.5 * gain(loss_direct) else "mixed"


def used_split(q):
    """The split on the used layers (USED_GATE): (used layers, loss direct, loss other, reading), from measure's
    own split, else exact from the per-layer one where at most one layer is used; None where it needs the model."""
    used = [i + 1 for i, layer in enumerate(q["layers"]) if layer["gate_sa"] >= USED_GATE]
    if "loss_direct_used" in q:
        d, o = q["loss_direct_used"], q["loss_other_used"]
    elif len(used) == 1:
        d, o = q["layers"][used[0] - 1]["loss_inside"], q["layers"][used[0] - 1]["loss_outside"]
    elif not used:  # no query is direct
        d, o = None, q["second"]
    else:
        return None
    return used, d, o, path_reading(q["first"], q["second"], d, o)


def plot(p, paths, T):
    """lm1024_paths.png: each SA+SWA copy model's copied-half loss on direct and on other queries, beside its first
    half, against the window; and its SA gate by layer."""
    fig, axes = p.subplots(1, 2, figsize=(10, 3.6))
    windows = sorted({q["window"] for q in paths.values()})
    for q in paths.values():
        layer = q["sa_perm"] == "layer"
        for field, color, label in (("first", "0.6", "first half"), ("loss_other", "C0", "copied half, other"),
                                    ("loss_direct", "C3", "copied half, direct")):
            if q[field] is not None:
                axes[0].scatter(q["window"] * (1.1 if layer else 1), q[field], color=color,
                                marker="s" if layer else "o", s=14, label=label)
        axes[1].plot(range(1, len(q["layers"]) + 1), [x["gate_sa"] for x in q["layers"]], marker=".", alpha=0.7,
                     color=f"C{windows.index(q['window'])}", ls="-." if layer else "-",
                     label=f"w={q['window']}" + ", one permutation per layer" * layer)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(windows, [str(w) for w in windows])
    axes[0].set_xlabel("window w (squares: one permutation per layer)")
    axes[0].set_ylabel("loss (nats per byte)")
    axes[0].set_title(f"what carries the copy (T={T}): source in an SA window or not", fontsize=9)
    axes[1].set_xticks(range(1, len(q["layers"]) + 1))
    axes[1].set_xlabel("layer")
    axes[1].set_ylabel("mean SA gate, copied-half queries")
    for ax in axes:
        once = {}
        for handle, label in zip(*ax.get_legend_handles_labels()):
            once.setdefault(label, handle)                                     # each label once, its first marker
        ax.legend(once.values(), once.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(common.out, "lm1024_paths.png"), dpi=120)

def gates(q):
    """A model's mean SA gate on copied-half queries, per layer."""
    return [layer["gate_sa"] for layer in q["layers"]]


def table(paths, sequences, draws):
    """lm1024.json's copy_paths, a row per model: its halves, the direct share beside the masks' prediction, the loss
    of direct and other queries, the SA gate by layer, the pre-registered reading, and the split on the used layers."""
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    used = lambda u: "needs the model (more than one layer used)" if u is None else (  # noqa: E731
        f"{', '.join(map(str, u[0])) or 'none'}: {fmt(u[1])} / {fmt(u[2])}, {u[3]}")
    lines = [f"What carries the copy: {sequences} val copy sequences (the same for every model), {draws} draws; a "
             "copied-half query is direct where its source is in its SA window in some layer and head", "",
             "| model | first half | copied half | direct: share (masks predict) | loss direct | loss other | "
             "SA gate by layer | reading | used layers (SA gate >= 0.1): loss direct / other, reading |",
             "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [
        f"| {name} | {q['first']:.3f} | {q['second']:.3f} | {q['direct']:.3f} ({q['direct_predicted']:.3f}) | "
        f"{fmt(q['loss_direct'])} | {fmt(q['loss_other'])} | {', '.join(f'{x:.2f}' for x in gates(q))} | "
        f"{q['reading']} | {used(used_split(q))} |"
        for name, q in sorted(paths.items(), key=lambda kv: (kv[1]["window"], kv[0]))])
