"""Test helpers shipped with checkpoint-store."""
