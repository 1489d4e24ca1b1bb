"""Tests of local staging: the uploader, restore, crash and fault injection, hostile targets."""
