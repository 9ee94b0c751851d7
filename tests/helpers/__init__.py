"""Plain helpers (functions, constants, model builders) shared by test modules:
``from tests.helpers.paths import ROOT``. Fixtures live in ``conftest.py`` files."""
