//! ramlog-server (under construction in this change set).
