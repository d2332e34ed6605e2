"""Choosing plans from measured costs: units and their costs, the search, the choice, AutoBatch, escalation."""
