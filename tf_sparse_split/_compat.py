"""Old module paths (before the layout by role, issue 13), kept importable.

``tf_sparse_split.stats``, ``.cost_model``, ``.conv_layers``, ``.datasets``,
``.profile``, ``.dropout`` and ``.cli`` were files; they are registered here
in ``sys.modules`` instead (no files at the old paths, so version control
follows the moved files):

* a path whose module moved whole is an alias of the new module
  (``tf_sparse_split.stats is tf_sparse_split.tuning.stats``);
* a path whose module was split is a small module re-exporting the public
  names of the new ones (``dropout``: the layers and the pattern search;
  ``cli``: ``main``, ``build_parser`` and the model builders).

``tf_sparse_split.ops``, ``.layers`` and ``.callbacks`` became packages that
export the same names, so they need nothing here.
"""

import importlib
import sys
import types

# old name -> new module (moved whole)
_ALIASES = {
    "stats": "tf_sparse_split.tuning.stats",
    "cost_model": "tf_sparse_split.tuning.cost_model",
    "conv_layers": "tf_sparse_split.layers.conv2d",
    "datasets": "tf_sparse_split.tools.datasets",
    "profile": "tf_sparse_split.tools.profile",
}

# old name -> {new module: names re-exported} (split)
_SPLIT = {
    "dropout": {
        "tf_sparse_split.layers.dropout": (
            "ApproximateRandomDropout", "SensitivityAwareDropout"),
        "tf_sparse_split.tuning.pattern_search": (
            "PatternDistribution", "search_pattern_distribution",
            "pattern_list"),
    },
    "cli": {
        "tf_sparse_split.tools.cli": ("main", "build_parser"),
        "tf_sparse_split.tools.models": ("build_mlp", "build_cnn"),
    },
}


def install(package):
    """Registers the old module paths under ``package`` (the
    ``tf_sparse_split`` module object) and as its attributes."""
    prefix = package.__name__
    for old, new in _ALIASES.items():
        module = importlib.import_module(new)
        sys.modules.setdefault(f"{prefix}.{old}", module)
        setattr(package, old, sys.modules[f"{prefix}.{old}"])
    for old, sources in _SPLIT.items():
        full = f"{prefix}.{old}"
        if full not in sys.modules:
            shim = types.ModuleType(
                full, f"Old module path; re-exports names from "
                      f"{', '.join(sources)}.")
            names = []
            for new, exported in sources.items():
                module = importlib.import_module(new)
                for name in exported:
                    setattr(shim, name, getattr(module, name))
                    names.append(name)
            shim.__all__ = names
            sys.modules[full] = shim
        setattr(package, old, sys.modules[full])
