#!/bin/sh
# The images' entry point. Arguments that start like the pipeline's own (`--config X`, `key=value`
# overrides) run the pipeline with them; anything else runs as a command (`make test`,
# `ray start ...`, `bash`).
set -e
case "${1:-}" in
  -* | *=*) exec python run_pipeline.py "$@" ;;
esac
exec "$@"
