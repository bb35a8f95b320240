"""The GPU run: ``bash scripts/gpu/run_all.sh OUTDIR`` (each check a module here; see run_all.sh)."""
