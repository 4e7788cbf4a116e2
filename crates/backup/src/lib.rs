//! ramlog-backup (under construction in this change set).
