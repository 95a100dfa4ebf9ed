"""Provider adapters: each runs exactly the concrete target it is given."""
