"""Pipeline stages: each is ``run(config, *, progress) -> (manifest, path)``; the CLI only translates."""
