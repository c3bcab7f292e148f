"""`tierkv bench`: measurements of the engine and each tier beside a baseline from the same run."""
