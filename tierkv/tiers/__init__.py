"""Storage mechanisms behind one contract (`tierkv.tiers.base.Tier`)."""
