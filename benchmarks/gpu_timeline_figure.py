"""Draw the timeline ``benchmarks/gpu_world1.py --profile`` wrote: per iteration, when the host
launched its work and when the GPU ran it, and every call that made the host wait for the GPU.

    python benchmarks/gpu_timeline_figure.py results/gpu_timeline.json docs/img/gpu_timeline.png
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from commsched.bench import runner  # noqa: E402


def draw(timeline: dict, title: str):
    rows = timeline["iterations"]
    figure, axes = plt.subplots(figsize=(10, 2.6))
    for row in rows:
        colour = "tab:blue" if row["iteration"] % 2 == 0 else "tab:cyan"
        axes.barh(1, row["cpu_end_ms"] - row["cpu_start_ms"], left=row["cpu_start_ms"], color=colour,
                  edgecolor="black", linewidth=0.5)
        axes.barh(0, row["gpu_end_ms"] - row["gpu_start_ms"], left=row["gpu_start_ms"], color=colour,
                  edgecolor="black", linewidth=0.5)
        axes.text((row["cpu_start_ms"] + row["cpu_end_ms"]) / 2, 1, f"it. {row['iteration']}",
                  ha="center", va="center", fontsize=8)
    for call in timeline["host_blocking_calls"]:
        axes.axvline(call["at_ms"], color="tab:red", linewidth=1.5)
    axes.set_yticks([0, 1], ["GPU runs", "host launches"])
    axes.set_xlabel("ms")
    inside = [call for call in timeline["host_blocking_calls"]
              if any(row["cpu_start_ms"] <= call["at_ms"] <= row["cpu_end_ms"] for row in rows)]
    axes.set_title(f"{title}\nhost waits for the GPU inside the {len(rows)} iterations: {len(inside)} "
                   "(red: every wait, the benchmark's own synchronize after them included)", fontsize=9)
    figure.tight_layout()
    return figure


def main() -> None:
    parser = runner.make_parser(__doc__, summary_only=True)
    parser.add_argument("timeline", help="the JSON written by gpu_world1.py --profile")
    parser.add_argument("png")
    parser.add_argument("--system", default="commsched", help="which profiled system to draw (default: commsched)")
    parser.add_argument("--title", default="commsched (default Strategy), ResNet-50, one H100, under torch.profiler")
    args = parser.parse_args()
    timelines = runner.read_rows(args.timeline)
    timeline = timelines[args.system] if "iterations" not in timelines else timelines  # older files hold one
    draw(timeline, args.title).savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
