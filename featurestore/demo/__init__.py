"""The card-fraud demo: a seeded data generator and the end-to-end pipeline (`featurestore demo`)."""
