"""The learning check's figure (tools/checks/learning_check.py): reasoner reward and held-out accuracy per
run; with --selfplay a second row for the challenger."""
from __future__ import annotations


def plot_runs(runs: dict, before: dict, path: str, selfplay: bool = False) -> None:
    """Reasoner reward and held-out accuracy; with --selfplay a second row for the challenger: its
    training-document curves and, against the fixed reasoner on held-out stories, its variance
    reward, frontier share and gold-right rate per evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [[("reward", "training reward (reasoner pass rate)", "training"), ("heldout", "", "accuracy")]]
    if selfplay:
        rows[0] += [("challenger_reward", "challenger reward, training documents", "training"),
                    ("frontier_share", "frontier share, training documents", "training"),
                    ("leak_rate", "leak rate (answer in the question)", "training")]
        rows.append([(m, f"held-out challenger: {t} (fixed reasoner)", "heldout_challenger")
                     for m, t in (("variance_reward", "variance reward"), ("frontier_share", "frontier share"),
                                  ("gold_right", "gold right"), ("valid_rate", "valid rate"))])
    width = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), width, figsize=(5.5 * width, 4 * len(rows)), squeeze=False)
    for row, panels in zip(axes, rows):
        for ax, (key, title, kind) in zip(row, panels):
            for name, r in runs.items():
                if kind == "accuracy":
                    xs, ys = zip(*r["heldout"])
                elif kind == "heldout_challenger":
                    curve = r.get("heldout_challenger", {})
                    xs, ys = list(curve), [curve[i][key] for i in curve]
                else:
                    ys = r.get(key, [])  # a run kept by an older version of this tool may lack a curve
                    xs = range(1, len(ys) + 1)
                ax.plot(xs, ys, marker="o" if kind != "training" else ".", label=name)
            if kind == "accuracy":
                ax.axhspan(before["ci"][0], before["ci"][1], color="grey", alpha=0.2, label="before (95% CI)")
                title = "held-out greedy accuracy (%)"
            ax.set(title=title, xlabel="iteration")
            ax.legend(fontsize=8)
        for ax in row[len(panels):]:
            ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
