"""Sphinx configuration: the API reference, built from the docstrings.

Build: ``sphinx-build -W -b html docs docs/_build`` (warnings are errors; CI
runs it).
"""

import jmp_lite

project = "jmp_lite"
author = "The jmp_lite developers"
release = jmp_lite.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# Google-style docstrings (Args/Returns/Raises/Example), as optax and Flax write them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as fields of their class: NamedTuple fields are members too, and
# a second description of each would be a duplicate.
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
exclude_patterns = ["_build"]
html_theme = "alabaster"
