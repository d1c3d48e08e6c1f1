"""The native store over obstore (Rust): :mod:`.store` the adapter, :mod:`.config` the
translation of storage options and environment into its configuration.
"""
