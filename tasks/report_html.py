"""`reports/index.html`: one self-contained page, tables and matplotlib figures, readable offline.

Every figure is an SVG drawn by matplotlib (Agg, no display needed) and
embedded as a `data:image/svg+xml;base64` image: no CDN, no script, no file
beside the page, and each figure is an <img> whose natural size a browser can
check. Text in the SVGs stays text (`svg.fonttype: none`), so the page stays
small and searchable. Each section that lacks its input says so in one line.
"""

from __future__ import annotations

import base64
import html
import io
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tasks.report import (
    ABLATION_ROWS, CURVE_KEYS, PARITY_MIN_VALID_FORMAT, PARITY_R1_TOLERANCE, SPEC_PREFIX, ReportInputs, ar_reference, dig,
    format_headline, headline_metrics, parity_point, setting_label,
)  # fmt: skip
from tasks.common import STAGES

# The published result the pipeline measures itself against (../shared/ARCHITECTURE.md).
PUBLISHED = "Published (Amazon Beauty, 10 candidates): Diffusion-GR2 R@1 0.2951 vs GR2 0.2960, pre-rank order 0.2811, at 2.4-3.5x GR2's decode speed."

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.88em}
th,td{border:1px solid #ddd;padding:.25em .55em;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
.note{color:#666;font-style:italic}.fig{margin:.8em 0}.fig img{max-width:100%;height:auto}
nav a{margin-right:1em}
"""


# --- figures ------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: draws the same in a terminal session and in CI
    import matplotlib.pyplot as plt

    return plt


def close_figure(fig: Any) -> None:
    """Free a figure that was drawn but not embedded (pyplot keeps every open figure alive)."""
    _pyplot().close(fig)


def figure_img(fig: Any, alt: str) -> str:
    """A matplotlib figure as an <img> with the SVG inline (base64); closes the figure."""
    plt = _pyplot()
    buf = io.BytesIO()
    # A fixed hash salt keeps the SVG's element ids (and so the page) the same for the same data.
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "gr2-report"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    # The DOCTYPE and the RDF metadata name URLs (never fetched, but a reader checking the page for
    # outside references should find none) and carry the date, which would change the page every run.
    svg = re.sub(r"<!DOCTYPE[^>]*>\s*|<metadata>.*?</metadata>\s*", "", buf.getvalue().decode("utf-8"), flags=re.S)
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return f'<div class="fig"><img alt="{html.escape(alt)}" src="data:image/svg+xml;base64,{data}"></div>'


def _img(fig: Any | None, alt: str) -> str:
    """`figure_img`, or "" for a figure with nothing to draw."""
    return "" if fig is None else figure_img(fig, alt)


def stage_figures(
    stage: str, metrics: Mapping[str, Any] | None, curves: Mapping[str, Sequence[tuple[int, float]]] | None, speed: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The report's figures that belong to one stage, as open matplotlib figures by file stem.

    Training curves for every stage with a history; `retrieve`: the pre-ranker
    against its baselines; `evaluate`: the ablation per split and the
    speed-accuracy trade-off per batch size. The caller saves and closes them.
    """
    figs: dict[str, Any] = {}
    if curves:
        figs[f"{stage}_training_curves"] = curves_plot(stage, curves)
    if stage == "retrieve" and isinstance((metrics or {}).get("full_ranking"), Mapping):
        for split in ("test", "valid"):
            if split in metrics["full_ranking"]:
                figs[f"retrieve_full_ranking_{split}"] = retrieve_plot(metrics["full_ranking"], split)
                break
    if stage == "evaluate" and metrics:
        models = ablation_models(metrics)
        for split in ("test", "valid"):
            figs[f"evaluate_ablation_{split}"] = ablation_plot(metrics, split, models)
        rows = (speed or {}).get("rows") or []
        for bs in sorted({int(r["batch_size"]) for r in rows if isinstance(r.get("batch_size"), int)}):
            figs[f"evaluate_speed_accuracy_batch{bs}"] = speed_plot(rows, bs)
    return {name: fig for name, fig in figs.items() if fig is not None}


def _ablation_figure(evaluate: Mapping[str, Any], split: str, models: Sequence[str]) -> str:
    return _img(ablation_plot(evaluate, split, models), f"Recall@1 with intervals, {split}")


def ablation_plot(evaluate: Mapping[str, Any], split: str, models: Sequence[str]) -> Any | None:
    """R@1 of each ablation row with its 95% interval, the pre-rank order as a reference line (None: no row)."""
    plt = _pyplot()
    rows = [(m, evaluate[m][split]) for m in models if dig(evaluate, f"{m}.{split}.recall@1") is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
    for i, (name, m) in enumerate(rows):
        r1 = float(m["recall@1"])
        ci = m.get("recall@1_ci95")
        xerr = [[r1 - ci[0]], [ci[1] - r1]] if ci else None
        ax.errorbar([r1], [i], xerr=xerr, fmt="o", color="C0" if not name.startswith(("dgr2", SPEC_PREFIX)) else "C1", capsize=3)
    if (pre := dig(evaluate, f"prerank.{split}.recall@1")) is not None:
        ax.axvline(float(pre), color="grey", linestyle="--", linewidth=1, label="pre-rank order")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(range(len(rows)), [n for n, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"Recall@1 ({split}), 95% bootstrap interval")
    ax.grid(axis="x", alpha=0.3)
    return fig


def _speed_series(rows: Sequence[Mapping[str, Any]], batch_size: int) -> dict[str, list[Mapping[str, Any]]]:
    """label -> rows of one decoder setting at this batch size, tau ascending (a curve from fast to careful)."""
    series: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("batch_size") != batch_size or r.get("decoder") in ("ar", "hf"):
            continue
        if r.get("decoder") == "spec":
            label = f"spec {r.get('model')}"
        else:
            sub = r.get("sub_block_size")
            expl = r.get("explanation_tau")
            label = f"{r.get('model')}" + (f" sub-block {sub}" if sub else "") + (f" explanation {expl:g}" if expl is not None else "")
        series.setdefault(label, []).append(r)
    for rs in series.values():
        rs.sort(key=lambda r: -1.0 if r.get("tau") is None else float(r["tau"]))
    return series


def speed_figure(rows: Sequence[Mapping[str, Any]], batch_size: int) -> str:
    return _img(speed_plot(rows, batch_size), f"speed-accuracy trade-off at batch size {batch_size}")


def speed_plot(rows: Sequence[Mapping[str, Any]], batch_size: int) -> Any | None:
    """R@1 and valid-format rate against speed-up over AR at one batch size: one point per tau and
    sub-block size, each point labelled with its tau, AR at 1x, the parity point ringed (None: no row)."""
    plt = _pyplot()
    ar = ar_reference(rows, batch_size)
    series = _speed_series(rows, batch_size)
    if ar is None and not series:
        return None
    parity = parity_point(rows, batch_size)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "recall@1", "Recall@1"), (axes[1], "valid_format_rate", "valid-format rate")):
        for i, (label, rs) in enumerate(series.items()):
            pts = [(float(r["speedup"]), float(r[key])) for r in rs if r.get("speedup") is not None and r.get(key) is not None]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i % 10}", label=label, alpha=0.85)
            for r, (x, y) in zip(rs, pts, strict=False):
                # tau labels on the validity panel only: on the R@1 panel the points often coincide.
                if r.get("tau") is not None and key == "valid_format_rate":
                    ax.annotate(f"{float(r['tau']):g}", (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7, color=f"C{i % 10}")
        if ar is not None and ar.get(key) is not None:
            ax.scatter([float(ar["speedup"])], [float(ar[key])], marker="*", s=180, color="black", zorder=5, label=f"AR ({ar.get('decoder')})")
            ax.axhline(float(ar[key]), color="black", linewidth=0.6, linestyle=":")
        if parity is not None and parity.get(key) is not None:
            ax.scatter([float(parity["speedup"])], [float(parity[key])], s=260, facecolors="none", edgecolors="red", linewidths=2, zorder=6, label="parity point")
        ax.axvline(1.0, color="grey", linewidth=0.6)
        ax.set_xlabel("speed-up over AR (tokens/s ratio)")
        ax.set_ylabel(title)
        ax.set_title(f"{title} vs speed-up, batch {batch_size}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    return fig


def curves_figure(stage: str, series: Mapping[str, Sequence[tuple[int, float]]]) -> str:
    return _img(curves_plot(stage, series), f"training curves of {stage}")


def curves_plot(stage: str, series: Mapping[str, Sequence[tuple[int, float]]]) -> Any | None:
    """One small panel per series of a stage's training history, against the training step (None: no series)."""
    plt = _pyplot()
    names = [k for k in series if series[k]]
    if not names:
        return None
    cols = min(3, len(names))
    nrows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(3.8 * cols, 2.6 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        pts = series[name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], linewidth=1.2, marker="." if len(pts) < 60 else None)  # sparse series: show each point
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(stage, fontsize=10)
    fig.tight_layout()
    return fig


def _retrieve_figure(full: Mapping[str, Any], split: str) -> str:
    return _img(retrieve_plot(full, split), f"pre-ranker against its baselines, {split}")


def retrieve_plot(full: Mapping[str, Any], split: str) -> Any | None:
    """Full-ranking R@10 and NDCG@10 of the pre-ranker and its baselines (bars; None: no model)."""
    plt = _pyplot()
    by_model = full.get(split) or {}
    names = [n for n in by_model if isinstance(by_model[n], Mapping) and "recall@10" in by_model[n]]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [float(by_model[n]["recall@10"]) for n in names], width=0.4, label="R@10")
    ax.bar([i + 0.2 for i in x], [float(by_model[n].get("ndcg@10", 0.0)) for n in names], width=0.4, label="NDCG@10")
    ax.set_xticks(list(x), names)
    ax.set_title(f"full ranking over every item ({split})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


# --- tables and sections -------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{digits}f}"
    if isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(v, (int, float)) for v in x):
        return f"[{x[0]:.4f}, {x[1]:.4f}]"
    return html.escape(str(x))


def _diff(d: Any) -> str:
    if not isinstance(d, Mapping) or "diff" not in d:
        return "-"
    ci = d.get("ci95") or [float("nan"), float("nan")]
    return f"{d['diff']:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An HTML table; cells are already escaped or formatted."""
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def note(text: str) -> str:
    """The one line a section prints instead of its content when its input is missing."""
    return f'<p class="note">{html.escape(text)}</p>'


def ablation_models(evaluate: Mapping[str, Any]) -> list[str]:
    """The ablation rows present, in the paper's order, then any `spec-*` rows."""
    return [m for m in ABLATION_ROWS if m in evaluate] + sorted(m for m in evaluate if m.startswith(SPEC_PREFIX))


def section_ablation(inputs: ReportInputs) -> str:
    ev = inputs.evaluate
    if not ev:
        return note("No metrics/evaluate.json: run the `evaluate` stage for the ablation table.")
    models = ablation_models(ev)
    if not models:
        return note("metrics/evaluate.json holds none of the ablation rows.")
    splits = [s for s in ("test", "valid") if any(s in (ev.get(m) or {}) for m in models)]
    splits += sorted({s for m in models for s in (ev.get(m) or {})} - set(splits))
    head = ["model", "R@1", "R@1 95% CI", "R@1 - prerank [95% CI]", "R@1 - gr2 [95% CI]", "NDCG@3", "NDCG@3 95% CI", "R@3",
            "valid format", "valid perm", "copies incoming", "n"]  # fmt: skip
    parts = [f"<p>{html.escape(PUBLISHED)}</p>"]
    for split in splits:
        rows = []
        for model in models:
            m = (ev.get(model) or {}).get(split)
            if not isinstance(m, Mapping):
                continue
            rows.append([
                html.escape(model), _fmt(m.get("recall@1")), _fmt(m.get("recall@1_ci95")), _diff(m.get("recall@1_vs_prerank")),
                _diff(m.get("recall@1_vs_gr2")), _fmt(m.get("ndcg@3")), _fmt(m.get("ndcg@3_ci95")), _fmt(m.get("recall@3")),
                _fmt(m.get("valid_format_rate")), _fmt(m.get("valid_permutation_rate")), _fmt(m.get("copy_incoming_rate")),
                _fmt(int(m["n"]) if isinstance(m.get("n"), (int, float)) else None),
            ])  # fmt: skip
        parts.append(f"<h3>{html.escape(split)}</h3>" + table(head, rows) + _ablation_figure(ev, split, models))
    return "\n".join(parts)


def section_speed(inputs: ReportInputs) -> str:
    sp = inputs.speed
    rows = (sp or {}).get("rows") or []
    if not rows:
        return note("No metrics/speed.json rows: the decode benchmark runs in `evaluate` once a diffusion checkpoint exists (or `gr2 bench decode`).")
    head = (
        f"<p>{_fmt(sp.get('examples'))} test examples on {_fmt(sp.get('device'))} with {_fmt(sp.get('threads'))} threads. "
        f"Speed-up is tokens per second over the best AR decoder for GR2's weights at the same batch size, measured in the same run. "
        f"Parity point: the fastest diffusion setting whose R@1 is within {PARITY_R1_TOLERANCE} of AR's and whose valid-format rate "
        f"is at least {PARITY_MIN_VALID_FORMAT} (the promotion gates' bar), judged on every validation and test example for the "
        f"setting the accuracy table decodes, else on these examples if one of them is worth no more than the tolerance; "
        f"the labels on the right-hand points are tau.</p>"
    )
    parts = [head]
    summary = []
    for bs in sorted({int(r["batch_size"]) for r in rows if isinstance(r.get("batch_size"), int)}):
        p = parity_point(rows, bs)
        fastest = max((r for r in rows if r.get("batch_size") == bs and r.get("decoder") == "diffusion"), key=lambda r: float(r.get("speedup") or 0), default=None)
        summary.append([
            str(bs), f"{float(p['speedup']):.2f}x ({html.escape(str(p['model']))}, {html.escape(setting_label(p))})" if p else "none",
            f"{float(fastest['speedup']):.2f}x ({html.escape(str(fastest['model']))}, {html.escape(setting_label(fastest))}, R@1 {_fmt(fastest.get('recall@1'))}, valid {_fmt(fastest.get('valid_format_rate'))}"
            + (f", explanation NLL {_fmt(fastest.get('explanation_nll_gr2'))}" if fastest.get("explanation_nll_gr2") is not None else "") + ")" if fastest else "-",
        ])  # fmt: skip
        parts.append(speed_figure(rows, bs))
    parts.insert(1, table(["batch size", "speed-up at parity", "fastest diffusion setting"], summary))
    return "\n".join(parts)


def section_curves(inputs: ReportInputs) -> str:
    if not inputs.curves:
        why = inputs.curves_note or "no stage logged a per-step history"
        return note(f"No training curves: {why}.")
    parts = []
    for stage in (s for s in CURVE_KEYS if s in inputs.curves):
        parts.append(f"<h3>{html.escape(stage)}</h3>" + curves_figure(stage, inputs.curves[stage]))
    missing = [s for s in CURVE_KEYS if s not in inputs.curves and s in inputs.stage_metrics]
    if missing:
        parts.append(note(f"No per-step history found for: {', '.join(missing)}."))
    return "\n".join(parts)


def section_retrieve(inputs: ReportInputs) -> str:
    m = inputs.stage_metrics.get("retrieve")
    if not m:
        return note("No metrics/retrieve.json: run the `retrieve` stage for the pre-ranker's metrics.")
    parts = []
    full = m.get("full_ranking") or {}
    for split in (s for s in ("test", "valid") if s in full):
        rows = [
            [html.escape(name)] + [_fmt(v.get(k)) for k in ("recall@5", "recall@10", "ndcg@5", "ndcg@10")] + [_fmt(v.get("n"))]
            for name, v in full[split].items() if isinstance(v, Mapping)
        ]  # fmt: skip
        parts.append(f"<h3>full ranking, {html.escape(split)}</h3>" + table(["model", "R@5", "R@10", "NDCG@5", "NDCG@10", "n"], rows))
        if split == "test":
            parts.append(_retrieve_figure(full, split))
    rerank = m.get("rerank") or {}
    if rerank:
        rows = [
            [html.escape(split)] + [_fmt(v.get(k)) for k in ("recall@1", "recall@3", "recall@5", "ndcg@3", "coverage", "n", "n_examples")]
            for split, v in rerank.items() if isinstance(v, Mapping)
        ]  # fmt: skip
        parts.append(
            f"<h3>candidate lists (K={_fmt(m.get('k'))}), the pre-rank order</h3>"
            + table(["split", "R@1", "R@3", "R@5", "NDCG@3", "coverage (target in list)", "lists with target", "examples"], rows)
        )
    if isinstance(m.get("prerank"), Mapping):
        parts.append("<p>" + html.escape(", ".join(f"{k}: {v}" for k, v in m["prerank"].items())) + "</p>")
    return "\n".join(parts) if parts else note("metrics/retrieve.json has no full-ranking or candidate-list metrics.")


def section_data(inputs: ReportInputs) -> str:
    m = inputs.stage_metrics.get("prepare")
    if not m:
        return note("No metrics/prepare.json: run the `prepare` stage for the data statistics.")
    rows = [[html.escape(k), _fmt(v)] for k, v in m.items() if not isinstance(v, (Mapping, list)) and not k.endswith("_s")]
    return table(["statistic", "value"], rows)


def section_stages(inputs: ReportInputs) -> str:
    rows = []
    for stage in STAGES:
        m = inputs.stage_metrics.get(stage)
        if m is None:
            continue
        seconds = m.get("seconds") if stage != "evaluate" else None
        rows.append([html.escape(stage), _fmt(seconds, 1), html.escape(format_headline(headline_metrics(stage, m, inputs.speed)))])
    if not rows:
        return note("No metrics/<stage>.json yet: run `gr2 run`.")
    return table(["stage", "seconds", "headline"], rows)


def section_registry(inputs: ReportInputs) -> str:
    if inputs.registry is None:
        return note(f"Registry: {inputs.registry_note or 'not read'}.")
    if not inputs.registry:
        return note("No registered model versions in this MLflow store.")
    rows = [
        [html.escape(r["model"]), html.escape(r["version"]), html.escape(", ".join(r["aliases"]) or "-"), html.escape(r["stage"] or "-"),
         time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"] / 1000)) if r.get("created") else "-",
         html.escape(r["decision"] or "-"), html.escape(r["failed_gates"] or "-"), html.escape(r["description"][:200] or "-")]
        for r in inputs.registry
    ]  # fmt: skip
    return table(["model", "version", "aliases", "stage", "registered", "promotion", "failed gates", "description"], rows)


SECTIONS: tuple[tuple[str, str, Callable[[ReportInputs], str]], ...] = (
    ("stages", "Stages", section_stages),
    ("ablation", "Ablation: re-ranking accuracy with 95% intervals", section_ablation),
    ("speed", "Speed-accuracy trade-off", section_speed),
    ("curves", "Training curves", section_curves),
    ("retrieve", "The pre-ranker", section_retrieve),
    ("data", "Data", section_data),
    ("registry", "Model registry", section_registry),
)


def render_html(inputs: ReportInputs) -> str:
    """The whole page. A section whose drawing fails says so in its place; the others still render."""
    body = []
    for anchor, title, fn in SECTIONS:
        try:
            content = fn(inputs)
        except Exception as exc:  # one malformed input must not cost the whole report
            content = note(f"This section could not be drawn: {type(exc).__name__}: {exc}")
        body.append(f'<h2 id="{anchor}">{html.escape(title)}</h2>\n{content}')
    nav = "".join(f'<a href="#{a}">{html.escape(t.split(":")[0])}</a>' for a, t, _ in SECTIONS)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Diffusion-GR2 report</title><style>{_CSS}</style></head><body>\n"
        f"<h1>Diffusion-GR2 report</h1><p>{html.escape(str(inputs.root))}, written {stamp}.</p><nav>{nav}</nav>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
