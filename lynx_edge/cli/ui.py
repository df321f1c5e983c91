"""All terminal output of the CLI: the only module that imports rich. Results go to stdout,
progress, notes and errors to stderr (so `-o json` pipes cleanly)."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import traceback
from pathlib import Path

from rich import box
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

_CONSOLES: dict[bool, Console] = {}


def console(stderr: bool = False) -> Console:
    # Created on first use; a Console writes to whatever sys.stdout/sys.stderr is at the time.
    if stderr not in _CONSOLES:
        c = Console(stderr=stderr, highlight=False, soft_wrap=True)  # one line stays one line
        if not c.is_terminal:  # pipes and files: do not wrap tables at 80 columns
            c.width = max(c.width, 200)
        _CONSOLES[stderr] = c
    return _CONSOLES[stderr]


# lines ---------------------------------------------------------------------------------------
def error(message: str, hint: str | None = None) -> None:
    line = Text.assemble(("error: ", "bold red"), (message, "red"))
    if hint:
        line.append(f" — {hint}", style="dim")
    console(True).print(line)


def print_traceback() -> None:
    console(True).print(Text(traceback.format_exc().rstrip(), style="dim"))


def warning(message: str) -> None:
    console(True).print(Text.assemble(("warning: ", "bold yellow"), (message, "yellow")))


def note(message: str, stderr: bool = True) -> None:
    console(stderr).print(Text(message, style="dim"))


def line(message: str = "", style: str | None = None) -> None:
    console().print(Text(message, style=style or ""))


def write(text: str) -> None:
    """Raw streamed text: no markup, no wrapping, flushed at once."""
    c = console()
    c.file.write(text)
    c.file.flush()


def read_line(prompt: str) -> str:
    """One line from the user (plain input(): works under any tty or pipe)."""
    return console().input(Text(prompt, style="bold green"))


def json_line(obj) -> None:
    write(json.dumps(obj, default=str) + "\n")


def csv_rows(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, keys, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    write(buf.getvalue())


@contextlib.contextmanager
def progress(description: str, unit: str = "bytes"):
    """→ callback(done, total); a transient bar on a terminal, nothing otherwise."""
    c = console(True)
    cols = [TextColumn("[dim]{task.description}"), BarColumn()]
    cols += [DownloadColumn()] if unit == "bytes" else [MofNCompleteColumn()]
    with Progress(*cols, TimeRemainingColumn(), console=c, transient=True, disable=not c.is_terminal) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        yield update


def progress_line(description: str):
    """→ callback(done, total) that keeps one status line on stderr: rewritten in place on a
    terminal, a new line per update elsewhere (logs and CI still show the run is alive)."""
    import time

    c, t0 = console(True), time.perf_counter()

    def update(done: int, total: int) -> None:
        text = f"{description}: {done}/{total} runs · {time.perf_counter() - t0:.0f} s"
        if c.is_terminal:
            c.file.write("\r" + text + ("\n" if done >= total else ""))
            c.file.flush()
        else:
            c.print(Text(text, style="dim"))

    return update


# numbers ---------------------------------------------------------------------------------------
def fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _pm(row: dict, key: str, fmt: str = "{:.1f}") -> str:
    if row.get(key) is None:
        return "–"
    std = row.get(key + "_std")
    return fmt.format(row[key]) + (f" ±{fmt.format(std)}" if std else "")


# chat ------------------------------------------------------------------------------------------
def stats_parts(stats: dict) -> list[str]:
    cached = f", {stats['cached_prompt_tokens']} cached" if stats.get("cached_prompt_tokens") else ""
    parts = [f"prefill {stats.get('prompt_tokens', 0)} tok{cached} at {stats.get('prefill_tok_s', 0):.1f} tok/s",
             f"decode {stats.get('decode_tok_s', 0):.1f} tok/s ({stats.get('tpot_ms', 0):.1f} ms/tok)"]
    if "unique_experts_per_layer" in stats:
        parts.append(f"{stats['unique_experts_per_layer']:.2f} experts/layer")
    lynx = stats.get("lynx")
    if isinstance(lynx, dict) and "remap_rate_pct" in lynx:
        parts.append(f"remap {lynx['remap_rate_pct']:.1f}%")
    off = stats.get("offload")
    if isinstance(off, dict):
        if "hit_rate" in off:
            parts.append(f"cache hits {100 * off['hit_rate']:.0f}%")
        moved = off.get("bytes_h2d", off.get("bytes_moved"))
        if moved is not None:
            parts.append(f"moved {fmt_bytes(moved)}")
    parts.append(f"{stats.get('completion_tokens', 0)} tokens")
    return parts


def reasoning(text: str) -> None:
    """Streamed reasoning (a Harmony analysis channel): dimmed on a terminal, plain elsewhere."""
    c = console()
    c.print(Text(text, style="dim"), end="")
    c.file.flush()


def hidden_reasoning(tokens: int, done: bool, stderr: bool = False) -> None:
    """The one line that stands for reasoning not shown: on a terminal it counts up while the
    model reasons (rewritten in place), then stays; elsewhere it is written once, when done."""
    c = console(stderr)
    text = f"(reasoning hidden: {tokens} tokens{'' if done else ' …'} · --show-reasoning shows it)"
    if c.is_terminal:
        c.file.write("\r\x1b[2m" + text + "\x1b[0m\x1b[K" + ("\n" if done else ""))
        c.file.flush()
    elif done:
        note(text, stderr=stderr)


def stats_line(stats: dict, stderr: bool = False) -> None:
    console(stderr).print(Text(" · ".join(stats_parts(stats)), style="dim"))


def kv_table(title: str, rows: dict, stderr: bool = False) -> None:
    t = Table(title=title, show_header=False, title_justify="left", title_style="bold")
    t.add_column(style="cyan")
    t.add_column()
    for k, v in rows.items():
        t.add_row(str(k), v if isinstance(v, str) else json.dumps(v, default=str))
    console(stderr).print(t)


def _gib(n) -> str:
    if n is None:
        return "—"
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 or n == 0 else (f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB")


_VERDICT_STYLE = {"fits": "green", "tight": "yellow", "limited": "yellow", "does not fit": "bold red", "info": "dim"}


def plan_table(report: dict) -> None:
    """The memory plan (MemoryPlan.report()): each resource's steady and load-peak need, what the
    machine has, the verdict and the hint; then the parts, notes and the one-line summary."""
    slots = "" if report.get("expert_slots") is None else f" · {report['expert_slots']} of {report['total_experts']} experts cached on the GPU"
    t = Table(title=f"memory plan (dry run) · {report['mode']} · {report['device']} {report['dtype']} · experts "
                    f"{report['expert_format']} ({report['expert_bytes'] / 2**20:.2f} MiB each) · ctx {report['ctx']} × "
                    f"batch {report['batch']} · {report['machine']}{slots}", title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("resource", "left"), ("steady", "right"), ("load peak", "right"), ("has", "right"),
                          ("verdict", "left")):
        t.add_column(name, justify=justify)
    for r in report["resources"]:
        has = "unlimited" if r["available_bytes"] is None and r["key"] == "pinned" else _gib(r["available_bytes"])
        v = Text(r["verdict"], style=_VERDICT_STYLE.get(r["verdict"], ""))
        if r["hint"]:
            v.append(f" — {r['hint']}")
        t.add_row(r["name"], _gib(r["steady_bytes"]), _gib(r["peak_bytes"]), has, v)
    console().print(t)
    for r in report["resources"]:
        detail = "; ".join(f"{k} {_gib(v)}" for k, v in r["parts"].items())
        if detail or r["note"]:
            note(f"{r['name']}: " + "; ".join(x for x in (detail, r["note"]) if x), stderr=False)
    for n in report.get("notes", []):
        note(n, stderr=False)
    line(report["summary"], style="green" if report["fits"] else "bold red")


DEMO_NOTE = ("the demo is a 14M-parameter code-continuation model trained on the Python standard library, "
             "not an assistant: give it the start of some Python (e.g. `def fibonacci(n):`)")


def is_demo(model: str) -> bool:
    """Whether the model directory is the embedded demo."""
    from ..hub import demo_dir

    try:
        return Path(model).resolve() == demo_dir()
    except OSError:
        return False


def model_note(demo: bool, raw: bool | None = None) -> None:
    """One line on stderr saying what the embedded demo model is (nothing for other models: demo
    is is_demo's answer); raw: chat's mode, said too."""
    if demo:
        mode = "" if raw is None else ("; chat runs it as raw completion (--no-raw: through its ChatML template)" if raw
                                       else "; --raw runs it as raw completion, without the ChatML template it never saw")
        note(DEMO_NOTE + mode, stderr=True)


def chat_banner(model: str, lynx: str, commands: dict, raw: bool | None = None, demo: bool = False) -> None:
    note(f"lynx-edge chat · {model} · lynx {lynx}", stderr=False)
    model_note(demo, raw)
    note("  ".join(commands) + '   (end a line with \\ or wrap in """ for several lines)', stderr=False)


# bench / eval ----------------------------------------------------------------------------------
def bench_table(result: dict) -> None:
    cfg = result["config"]
    extra = "".join(f" · {k}" for k in ("int4", "offload") if cfg.get(k))
    extra += "".join(f" · {name}" for k, name in (("int4_attn", "int4 attn"), ("int8_head", "int8 head")) if cfg.get(k))
    extra += f" · {cfg['int4_act']} activations" if cfg.get("int4_act") in ("q8", "q16") else ""
    extra += " · bf16 activations" if cfg.get("bf16_act") == "bf16" else ""
    threads = f" · {cfg['threads']} thread{'s' if cfg['threads'] > 1 else ''}" if cfg.get("threads") else ""
    t = Table(title=f"{cfg['model']} · {cfg['device']} {cfg['dtype']}{extra}{threads} · prompt {cfg['prompt_len']} · "
                    f"gen {cfg['gen_len']} · {cfg['reps']} reps", title_justify="left", box=box.SIMPLE_HEAD)
    cols = [("batch", "batch", "{}"), ("lynx", "lynx", "{}"), ("prefill tok/s", "prefill_tok_s", "{:.1f}"),
            ("decode tok/s", "decode_tok_s", "{:.1f}"), ("TPOT ms", "tpot_ms", "{:.2f}"),
            ("experts/layer", "unique_experts_per_layer", "{:.2f}"), ("remap %", "remap_pct", "{:.1f}"),
            ("bytes/tok", "bytes_per_token", "{:.3g}"), ("hit %", "hit_rate_pct", "{:.1f}"),
            ("proj. tok/s", "proj_tok_s", "{:.1f}"), ("proj. hit %", "proj_hit_rate_pct", "{:.1f}"),
            ("proj. bytes/tok", "proj_bytes_per_token", "{:.3g}")]
    cols = [c for c in cols if any(r.get(c[1]) is not None for r in result["rows"])]
    for name, _, _ in cols:
        t.add_column(name, justify="right", no_wrap=True)
    for r in result["rows"]:
        t.add_row(*(str(r[k]) if k in ("batch", "lynx") else _pm(r, k, f) for _, k, f in cols))
    console().print(t)
    if cfg.get("simulate"):
        sim = cfg["simulate"]
        note(f"proj. = projected for {sim['shape']} on profile {sim['profile']} (replayed routing, not measured)",
             stderr=False)
    if result.get("compare"):
        c = Table(title="LYNX vs exact", title_justify="left", box=box.SIMPLE_HEAD)
        quality = any("ppl_change_pct" in r for r in result["compare"])
        heads = ["batch", "mode", "decode speed-up (min–max)", "experts −%"]
        heads += (["ppl Δ%", "greedy agree %"] if quality else []) + ["verdict"]
        for h in heads:
            c.add_column(h, justify="right" if h != "verdict" else "left")
        for r in result["compare"]:
            cells = [str(r["batch"]), r["lynx"], speedup_text(r), _pm(r, "unique_reduction_pct")]
            if quality:
                cells += [_pm(r, "ppl_change_pct", "{:+.2f}"), _pm(r, "greedy_agreement_pct")]
            c.add_row(*cells, r.get("verdict", ""))
        console().print(c)
        note("speed-up: median of the per-repetition decode tok/s ratios, min–max beside it (modes "
             "alternate within each repetition, so background load hits both alike)", stderr=False)
        if result.get("quality_note") or result.get("quality"):
            note(f"quality: {result.get('quality') or result.get('quality_note')}", stderr=False)


def speedup_text(r: dict) -> str:
    """1.12× (0.98–1.30) — the spread keeps a noisy mean from reading as a result."""
    text = f"{r['speedup']:.2f}×"
    if r.get("speedup_min") is not None:
        text += f" ({r['speedup_min']:.2f}–{r['speedup_max']:.2f})"
    return text


def eval_table(rows: list[dict], title: str) -> None:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    cols = [("batch", "batch", "{}"), ("experts exact", "unique_exact", "{:.2f}"),
            ("experts LYNX", "unique_lynx", "{:.2f}"), ("reduction %", "reduction_pct", "{:.1f}"),
            ("ppl exact", "ppl_exact", "{:.3f}"), ("ppl LYNX", "ppl_lynx", "{:.3f}"),
            ("ppl change %", "ppl_change_pct", "{:+.2f}"), ("greedy agree %", "greedy_agreement_pct", "{:.1f}")]
    for name, _, _ in cols:
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(*(_pm(r, k, f) for _, k, f in cols))
    console().print(t)
