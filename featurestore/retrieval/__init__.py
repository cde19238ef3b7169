"""Reading features back: point-in-time joins (offline), lookups (online), dataset export."""
