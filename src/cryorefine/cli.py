"""The `cryorefine` command line: a click group, one function per command.

Logging, MPI and device set-up happen here only. Bad input ends with one line on stderr and
exit code 2 (a traceback only with --debug).
"""

from __future__ import annotations

import json
import sys

import click

from cryorefine import __version__
from cryorefine.errors import InputError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cryorefine")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
def cli(debug):
    """RELION-compatible cryo-EM 3D refinement (GPU E-step, MPI workers)."""


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the same as JSON.")
@click.option("--check-images", is_flag=True,
              help="Read every image: stacks exist, indices in range, one box size, no NaN/Inf pixels.")
def info(file, as_json, check_images):
    """What a particle STAR file or an MRC map/stack holds.

    For particles: count, optics groups (pixel size, box, voltage, Cs, Q0), stacks and whether
    they exist, defocus range, pose columns. For MRC: shape, pixel size, min/max/mean/rms.
    """
    from cryorefine.info import describe, format_text

    result = describe(file, check_images)
    click.echo(json.dumps(result, indent=2) if as_json else format_text(result))


def main(argv=None):
    """Console entry point: runs the group and turns errors into one line and an exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        cli.main(args=args, prog_name="cryorefine", standalone_mode=False)
    except click.exceptions.NoSuchOption as exc:
        _fail(f"{exc.format_message()} (this option is not implemented; see `cryorefine "
              f"{_command(exc)} --help`)", 2, debug)
    except click.exceptions.UsageError as exc:
        _fail(f"{exc.format_message()} (see `cryorefine {_command(exc)} --help`)", 2, debug)
    except click.exceptions.Abort:
        _fail("aborted", 130, False)
    except InputError as exc:
        _fail(str(exc), 2, debug)
    except MemoryError as exc:
        _fail(f"out of memory: {exc}; use a smaller batch or box", 3, debug)
    except Exception as exc:  # the last line of defence: one line, and the traceback with --debug
        _fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", 1, debug)
    return 0


def _command(exc):
    ctx = getattr(exc, "ctx", None)
    return ctx.command_path.split(" ", 1)[1] if ctx and " " in ctx.command_path else ""


def _fail(message, code, debug):
    if debug:
        raise
    click.echo(f"cryorefine: error: {' '.join(str(message).split())}", err=True)
    sys.exit(code)
