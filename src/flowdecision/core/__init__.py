"""The core: the decision wire model, identities and receipts, the one JSON
encoder, the shared limits and defaults, and the dispatcher that submits each
decision exactly once."""
