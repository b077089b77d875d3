"""MkDocs hooks (mkdocs.yml `hooks`): the pages read off the code. The CLI reference is a page
of its own; `<!-- strategy-table -->` and `<!-- report-fields -->` markers in a page are
replaced by the registry's strategies and report.json's fields (ditango_cli/manual.py,
runtime/report_fields.py)."""

from __future__ import annotations

from mkdocs.structure.files import File

from ditango_cli.app import app
from ditango_cli.manual import cli_reference, strategy_table
from runtime.report_fields import ITEM_FIELDS, RUN_FIELDS, field_table


def on_files(files, config):
    files.append(File.generated(config, "reference/cli.md", content=cli_reference(app)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    return (
        markdown.replace("<!-- strategy-table -->", strategy_table())
        .replace("<!-- report-fields -->", "### report.json\n\n" + field_table(RUN_FIELDS))
        .replace("<!-- item-fields -->", "### An item's record\n\n" + field_table(ITEM_FIELDS))
    )
