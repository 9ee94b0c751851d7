"""trainer's tests, laid out like ``src/trainer/``: ``tests/<package>/`` tests
``trainer/<package>/``; ``package/`` the package as a whole and its top-level modules;
``workflows/`` end-to-end cases across packages; ``helpers/`` what tests share;
``children/`` scripts tests start as child processes.

``tests/`` and every folder of test modules is a package, so a test module's name is
unique (``tests.storage.test_locks``) whatever its file is called, pytest's default
``prepend`` import mode puts the repository root on ``sys.path`` (not ``tests/``), and no
test folder named like a library (``tests/tensorboard/``) can shadow it.
"""
