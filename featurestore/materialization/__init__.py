"""One computation per view feeds both stores: source → transformation → typed history rows."""
