"""Charts of a run from its metrics (run_metrics.py): reward and accuracy, response length, KL / entropy / grad
norm, and the per-iteration timeline of the phases (how rollout, reward, reference pass, update and weight sync
overlap). `plot_run` writes the four PNGs; rendering is matplotlib's Agg (no display needed).
"""

from __future__ import annotations

from pathlib import Path

from services.report.run_metrics import (
    Metrics,
    phase_spans,
    representative_iterations,
    rolling_mean,
    series,
)

# Colours of the phases a timeline shows; a phase not named here (a new one) gets one of OTHER_COLORS.
PHASE_COLORS = {"rollout": "#4C72B0", "rule_reward": "#DD8452", "reward_model": "#DA8BC3",
                "reference_model": "#55A868", "old_log_p": "#8172B3", "adv": "#937860", "update": "#C44E52",
                "resharding_to_infer": "#64B5CD", "resharding_enter_infer": "#64B5CD",
                "resharding_exit_infer": "#9BD0E0", "resharding_to_train": "#8C8C8C",
                "resharding_enter_train": "#8C8C8C", "resharding_exit_train": "#B5B5B5", "ref_onload": "#A6D8A8",
                "ref_offload": "#A6D8A8"}
OTHER_COLORS = ("#CCB974", "#8EBA42", "#E24A33", "#348ABD")

_RAW = {"alpha": 0.3, "linewidth": 0.8}
_SMOOTH = {"linewidth": 2.0}


def plot_run(metrics: Metrics, out_dir: Path, title: str = "") -> list[Path]:
    """Writes the four PNGs to `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # before the first pyplot import (in each figure)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [reward(metrics, out_dir / "reward.png", title),
            response_length(metrics, out_dir / "response_length.png", title),
            training(metrics, out_dir / "kl_entropy_grad_norm.png", title),
            timeline(metrics, out_dir / "timeline.png", title)]


def _window(n: int) -> int:
    return max(5, n // 20)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _title(ax, text: str, run: str) -> None:
    ax.set_title(f"{text}" + (f"\n{run}" if run else ""), fontsize=11)


def reward(metrics: Metrics, path: Path, run: str) -> Path:
    """Training reward per iteration (raw and trailing mean) and every validation accuracy logged."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    it, r = series(metrics, "grpo/score/mean")
    w = _window(len(r))
    ax.plot(it, r, color="#4C72B0", label="reward per iteration (grpo/score/mean)", **_RAW)
    if len(r):
        ax.plot(it, rolling_mean(r, w), color="#4C72B0", label=f"reward, mean of last {w} iterations", **_SMOOTH)
        k = min(5, len(r))
        ax.text(0.01, 0.97, f"first {k} iterations: {r[:k].mean():.3f}   last {k}: {r[-k:].mean():.3f}",
                transform=ax.transAxes, va="top", fontsize=9, bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    val_keys = sorted({k for m in metrics for k in m
                       if k.startswith("val/") and ("pass@" in k or "mean@" in k) and k != "val/mean@1"})
    for key, color in zip(val_keys, ("#C44E52", "#55A868", "#8172B3", "#DD8452"), strict=False):
        vi, vv = series(metrics, key)
        ax.plot(vi, vv, marker="o", markersize=4, color=color, label=f"validation {key.removeprefix('val/')}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward / accuracy")
    if len(r) and r.min() >= 0 and r.max() <= 1:
        ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    _title(ax, "Reward and accuracy", run)
    return _save(fig, path)


def response_length(metrics: Metrics, path: Path, run: str) -> Path:
    """Mean response length per iteration, with the batch's min-max band."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    it, mean = series(metrics, "response_length/mean")
    _, lo = series(metrics, "response_length/min")
    _, hi = series(metrics, "response_length/max")
    if len(lo) == len(mean) == len(hi) and len(mean):
        ax.fill_between(it, lo, hi, color="#55A868", alpha=0.15, label="min - max in the batch")
    ax.plot(it, mean, color="#55A868", label="mean", **_RAW)
    ax.plot(it, rolling_mean(mean, _window(len(mean))), color="#55A868", label="mean, trailing average", **_SMOOTH)
    ax.set_xlabel("iteration")
    ax.set_ylabel("tokens")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    _title(ax, "Response length", run)
    return _save(fig, path)


def training(metrics: Metrics, path: Path, run: str) -> Path:
    """KL to the reference, policy entropy and gradient norm, one panel each."""
    import matplotlib.pyplot as plt

    panels = (("actor/kl_loss", "KL", "KL to the reference (actor/kl_loss)", "#C44E52"),
              ("actor/entropy", "entropy", "policy entropy per token (actor/entropy)", "#8172B3"),
              ("grad_norm", "grad norm", "gradient norm before clipping (grad_norm)", "#937860"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 7.5), sharex=True)
    for ax, (key, label, caption, color) in zip(axes, panels, strict=True):
        it, v = series(metrics, key)
        if len(v):
            ax.plot(it, v, color=color, **_RAW)
            ax.plot(it, rolling_mean(v, _window(len(v))), color=color, **_SMOOTH)
        else:
            ax.text(0.5, 0.5, f"{key} not logged", transform=ax.transAxes, ha="center", va="center")
        ax.set_ylabel(label)
        ax.text(0.01, 0.95, caption, transform=ax.transAxes, va="top", fontsize=8,
                bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("iteration")
    _title(axes[0], "KL, entropy and gradient norm (thin: per iteration, thick: trailing mean)", run)
    return _save(fig, path)


def timeline(metrics: Metrics, path: Path, run: str) -> Path:
    """Gantt of the phases inside a few iterations: what ran when, and what overlapped."""
    import matplotlib.pyplot as plt

    picks = representative_iterations(metrics)
    fig, axes = plt.subplots(len(picks), 1, figsize=(9, 1.0 + 2.2 * len(picks)), squeeze=False)
    logged_any = False
    for ax, m in zip(axes[:, 0], picks, strict=True):
        spans, logged = phase_spans(m)
        logged_any |= logged
        rows = [p for p, (start, end) in spans.items() if end > start]
        for y, phase in enumerate(rows):
            start, end = spans[phase]
            color = PHASE_COLORS.get(phase, OTHER_COLORS[y % len(OTHER_COLORS)])
            ax.barh(y, end - start, left=start, color=color, height=0.6)
            ax.text(end, y, f" {end - start:.3f}s", va="center", fontsize=7)
        total = m.get("timing/all", 0.0)
        ax.axvline(total, color="black", linewidth=1, linestyle="--")
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(total, *(e for _, e in spans.values())) * 1.15 or 1.0)
        ax.set_title(f"iteration {int(m['iteration'])}: timing/all {total:.3f} s (dashed)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the iteration's start")
    source = "logged timeline/{phase}/start|end" if logged_any else "reconstructed from timing/* by the parity rules"
    fig.suptitle(f"Phases within an iteration ({source})" + (f"\n{run}" if run else ""), fontsize=11)
    return _save(fig, path)


