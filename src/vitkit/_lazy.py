"""Names a package offers whose modules are imported on first use, so that importing the package (and so
``vitkit --help``, which needs only the command line's parsers) does not import torch: ``vitkit -h`` answered in
5 s when every package imported its modules up front, in 0.1 s since."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps a public name to the module (relative to
    the package, ``.datasets``) it comes from, or ``.name`` to the submodule ``name`` itself; a name is imported on
    first use and kept in ``namespace``."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(exports[name], package)
        value = module if exports[name] == f".{name}" else getattr(module, name)
        namespace[name] = value  # later lookups find it without this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
