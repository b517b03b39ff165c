"""The shipped configuration presets (the YAML files here), installed as ``gpo.configs``: ``gpo fit --config NAME``
finds one by name (``quickstart``, ``dapo.yaml``) when no file of that name exists where it runs."""
