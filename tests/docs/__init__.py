"""Tests of the documentation: pages, links, claims, README, doctests."""
