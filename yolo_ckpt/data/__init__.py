"""The embedded datasets and the project's data folders (``cfg/``, ``datasets/``)."""
