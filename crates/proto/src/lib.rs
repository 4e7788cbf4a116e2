//! ramlog-proto (under construction in this change set).
