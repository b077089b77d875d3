"""The `ditango` command: owns the Typer app and registers the commands of the modules beside
it (generate, check; models, download; status, cancel, report; simulate; rehearse), which never
import it.
Predictable mistakes print one `error: ...` line on stderr and exit 2; outputs that cannot be
written (a full disk) one line and exit 1."""

from __future__ import annotations

import shutil
import sys

import typer
from typer.core import TyperCommand, TyperGroup

from basics.errors import ConfigError
from ditango_cli import generate, jobs, models, rehearse, simulate
from ditango_cli.tables import say_error
from runtime.errors import OutputWriteError

EXIT_USAGE = 2
EXIT_FAILED = 1
# Below this many columns a command's --help is the plain layout: typer's panels share the width
# among six columns and cut option names ("--cache-memory-l…") in a 100-column terminal.
PANELS_FROM = 120


def _is_click_exception(exc: BaseException) -> bool:
    # Typer >= 0.25 vendors click (typer._click), older releases use click itself:
    # recognise either by class name rather than importing a private module.
    return any(cls.__name__ == "ClickException" for cls in type(exc).__mro__)


class FitsTheTerminal(TyperCommand):
    """A command whose --help fits the terminal: typer's option panels where it is wide enough,
    else click's plain layout, which wraps each option's help and never cuts its name. Flags show
    no value placeholder in either (typer's panels would write `<bool>`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    def format_help(self, ctx, formatter) -> None:
        if shutil.get_terminal_size().columns >= PANELS_FROM:
            return super().format_help(ctx, formatter)
        return super(TyperCommand, self).format_help(ctx, formatter)  # click's own layout


class OneLineErrors(TyperGroup):
    """Usage and configuration errors become one `error: ...` line and exit code 2."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            from runtime.models.registry import PLUGIN_ERRORS

            if PLUGIN_ERRORS:  # a family named in $DITANGO_FAMILIES or an entry point failed to register
                raise ConfigError(PLUGIN_ERRORS[0])
            result = super().main(*args, **kwargs)
        except ConfigError as exc:
            say_error(str(exc))
            sys.exit(EXIT_USAGE)
        except OutputWriteError as exc:  # a full disk, a read-only folder: not the user's typing
            say_error(str(exc))
            sys.exit(EXIT_FAILED)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(130)
        except Exception as exc:
            if not _is_click_exception(exc):
                raise
            message = exc.format_message()
            if message:  # empty for "no arguments: help shown"
                say_error(message)
            sys.exit(exc.exit_code)
        sys.exit(result if isinstance(result, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # option groups as panels; help texts hold [defaults] in brackets, kept as written
    help="Batch video generation with Diffusion Transformers.",
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"ditango {version('ditango')}")
        except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
            typer.echo("ditango (not installed: run ./scripts/setup.sh)")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Batch video generation with Diffusion Transformers."""


for fn in (
    generate.generate,
    generate.check,
    models.models,
    models.download,
    jobs.status,
    jobs.cancel,
    jobs.report,
    simulate.simulate,
    rehearse.rehearse,
):
    app.command(fn.__name__, cls=FitsTheTerminal)(fn)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
