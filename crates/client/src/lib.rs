//! ramlog-client (under construction in this change set).
