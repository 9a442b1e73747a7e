"""Published heuristic schedules, one module per family; importing this package registers them all.

Modules are found by listing the package, so adding a family is adding a file.
"""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
    importlib.import_module(f"{__name__}.{_module}")
