"""The test suite (a package, so that modules import the shared helpers relatively: ``from .helpers import ...``)."""
