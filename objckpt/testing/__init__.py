"""Test helpers for code that builds on objckpt; they need ``pytest`` (``pip install pytest``).

:class:`StoreConformance` is the store contract as a pytest suite. A store
package (registered through the ``objckpt.stores`` entry point or
:func:`objckpt.storage.register_store`) runs it with three lines::

    from objckpt.testing import StoreConformance

    class TestMyStore(StoreConformance):
        url = "mystore://bucket/prefix"

``import objckpt`` never imports this package, so objckpt itself does not
depend on pytest.
"""

import pytest

# Before the import below: failed checks in the suite then say what they compared.
pytest.register_assert_rewrite("objckpt.testing.store", "objckpt.testing.reads")

from objckpt.testing.store import StoreConformance  # noqa: E402

__all__ = ["StoreConformance"]
