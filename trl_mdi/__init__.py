"""trl_mdi."""
