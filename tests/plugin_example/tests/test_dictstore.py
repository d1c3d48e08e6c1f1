"""The plugin runs objckpt's store conformance suite on its scheme: three lines."""

from objckpt.testing import StoreConformance


class TestDictStore(StoreConformance):
    url = "dictstore://conformance"
