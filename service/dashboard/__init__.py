"""The auditors' dashboard: server-rendered HTML with inline SVG, built from plain numbers.

Nothing here reads the database or speaks HTTP (service/api/routes/dashboard.py does both), so the
pages are pure functions of the values the JSON API returns.
"""
