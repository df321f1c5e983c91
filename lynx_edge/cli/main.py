"""The `lynx-edge` typer app: one module per command; every command's errors become one red
line with a hint (LYNX_DEBUG=1 adds the traceback)."""
from __future__ import annotations

import functools
import inspect
import os
from typing import Annotated

import typer
from typer.exceptions import TyperException

from . import bench, chat, eval as eval_cmd, info, profile, quantize, serve, ui
from ..threads import set_threads
from .common import explain
from .options import Threads


def _flags_show_no_type() -> None:
    """typer 0.2x prints `<bool>` beside every flag in help (--help itself too), as if it took a value;
    a flag takes none, so its type column stays empty (options with a metavar of their own keep it)."""
    cls = getattr(getattr(typer, "core", None), "TyperOption", None)
    shown = getattr(cls, "display_type_rich", None)
    if shown is None or getattr(shown, "_flags_plain", False):  # another typer, or already done
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) and self.metavar is None else shown(self, ctx)

    display_type_rich._flags_plain = True
    cls.display_type_rich = display_type_rich


_flags_show_no_type()
app = typer.Typer(name="lynx-edge", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Fast Mixture-of-Experts inference on one edge GPU or CPU, with LYNX expert selection.")


def guarded(fn):
    """Run a command; an exception becomes `error: … — hint` on stderr and exit code 1.
    Every command also takes --threads/-t (llama.cpp's -t), applied before the command runs."""

    @functools.wraps(fn)
    def wrapper(*args, threads: int | None = None, **kwargs):
        try:
            set_threads(threads, explicit=threads is not None)
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, TyperException):  # usage errors: typer prints them itself
            raise
        except KeyboardInterrupt:
            ui.error("interrupted")
            raise typer.Exit(130) from None
        except Exception as exc:  # the one place every failure is turned into a line
            if os.environ.get("LYNX_DEBUG", "") not in ("", "0"):
                ui.print_traceback()
            ui.error(*explain(exc))
            raise typer.Exit(1) from None

    sig = inspect.signature(fn, eval_str=True)  # typer needs the Annotated objects, not strings
    extra = inspect.Parameter("threads", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Threads)
    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), extra])
    return wrapper


for _name, _fn in (("chat", chat.chat), ("bench", bench.bench), ("eval", eval_cmd.evaluate), ("info", info.info),
                   ("quantize", quantize.quantize), ("profile", profile.profile), ("serve", serve.serve)):
    app.command(_name)(guarded(_fn))


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        ui.line(f"lynx-edge {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="print the version and exit")] = False,
) -> None:
    """Fast Mixture-of-Experts inference on one edge GPU or CPU, with LYNX expert selection."""


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library warning at the CLI (int8_head off the CPU, float16 on a CPU, …): one yellow line on
    stderr, not Python's file:line and source echo."""
    ui.warning(str(message))


def main() -> None:
    import warnings

    warnings.showwarning = _one_line_warning
    app(prog_name="lynx-edge")


__all__ = ["app", "main"]
