"""Alembic migrations of the metadata DB (:mod:`fleet.db`). ``MetadataDB(url)`` upgrades to head on open;
see docs/store.md ("Migrations") for adding one."""
