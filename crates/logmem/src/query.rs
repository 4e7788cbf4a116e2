//! Scan queries: key filters, table schemas, predicates, projection and aggregation.
