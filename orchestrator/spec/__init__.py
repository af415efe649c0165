"""Job specs: their validation, spec files (TOML/YAML) and health settings."""
