"""Prompt rendering and output post-processing: templates, families, stops, reasoning."""
