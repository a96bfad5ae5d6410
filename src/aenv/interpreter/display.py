"""What the kernel shows, set up once in every python kernel the service starts (``kernels.py`` runs
:func:`install` as the kernel's start-up line): the result fields ``e2b-code-interpreter`` reads beyond
Jupyter's own MIME types.

- ``e2b/data``: a pandas DataFrame as ``{column: [values]}`` (timestamps as ISO strings) → ``Result.data``.
- ``e2b/chart``: a matplotlib figure described as data (type, title, axes, elements) by the
  ``e2b-charts`` package from PyPI → ``Result.chart``.
- A PIL image ``save()``d to a path is also displayed (a PNG result), as agents expect of a notebook.

Runs inside the kernel (the template's Python, with IPython, pandas, matplotlib): imports nothing from
aenv, and imports pandas/matplotlib only when the object shown could be theirs (already imported).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def dataframe_columns(obj: Any) -> dict[str, list[Any]] | None:
    """``{column: values}`` of a pandas DataFrame, or None for anything else."""
    pandas = sys.modules.get("pandas")
    if pandas is None or not isinstance(obj, pandas.DataFrame):
        return None
    columns: dict[str, list[Any]] = obj.to_dict(orient="list")
    return {str(name): [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
            for name, values in columns.items()}  # fmt: skip


def figure_chart(obj: Any) -> dict[str, Any] | None:
    """A matplotlib Figure described by ``e2b_charts``, {} when it cannot describe it, None for anything
    that is not a figure."""
    if "matplotlib" not in sys.modules:
        return None
    figure_type = importlib.import_module("matplotlib.figure").Figure
    if not isinstance(obj, figure_type):
        return None
    try:
        described: dict[str, Any] = importlib.import_module("e2b_charts").chart_figure_to_dict(obj)
    except Exception:  # noqa: BLE001 - a figure it cannot read still shows as an image
        return {}
    return described


def _formatter(shell: Any, mime: str, describe: Any) -> Any:
    """An IPython formatter for ``mime`` whose answer is ``describe(obj)`` (None: not this formatter's)."""
    formatters = importlib.import_module("IPython.core.formatters")
    traitlets = importlib.import_module("traitlets")

    class Formatter(formatters.BaseFormatter):  # type: ignore[misc,name-defined]
        format_type = traitlets.Unicode(mime)
        # what the base class looks for on objects this formatter does not describe: its default is
        # ``__repr__``, which would give every result (``1+1`` too) a data and a chart field
        print_method = traitlets.ObjectName("_repr_" + mime.replace("/", "_") + "_")
        _return_type = (dict, str)

        def __call__(self, obj: Any) -> Any:
            answer = describe(obj)
            return answer if answer is not None else super().__call__(obj)

    return Formatter(parent=shell.display_formatter)


def _display_saved_images() -> None:
    """``Image.save(path)`` also displays the image; a viewer never opens (there is no display)."""
    try:
        image_module = importlib.import_module("PIL.Image")
        viewers = importlib.import_module("PIL.ImageShow")
    except ImportError:
        return
    show = importlib.import_module("IPython.display").display
    viewers.UnixViewer.show_file = lambda self, path, **options: 0
    saved = image_module.Image.save
    if getattr(saved, "_aenv_displays", False):
        return

    def save(self: Any, fp: Any, format: Any = None, **params: Any) -> Any:  # noqa: A002 - PIL's name
        if isinstance(fp, str):
            show(self)
        return saved(self, fp, format, **params)

    save._aenv_displays = True  # type: ignore[attr-defined]
    image_module.Image.save = save


def install() -> None:
    """Register the formatters on the running IPython shell (once per kernel)."""
    shell = importlib.import_module("IPython").get_ipython()
    if shell is None:
        return
    formatters = shell.display_formatter.formatters
    formatters["e2b/data"] = _formatter(shell, "e2b/data", dataframe_columns)
    formatters["e2b/chart"] = _formatter(shell, "e2b/chart", figure_chart)
    _display_saved_images()
