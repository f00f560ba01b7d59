use std::collections::HashMap;
use std::fmt;

/// A parsed line of a key=value configuration file.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    Blank,
    Comment(String),
    Pair { key: String, value: String },
}

#[derive(Debug)]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

pub fn parse_line(number: usize, text: &str) -> Result<Line, ParseError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Ok(Line::Blank);
    }
    if let Some(rest) = trimmed.strip_prefix('#') {
        return Ok(Line::Comment(rest.trim().to_string()));
    }
    match trimmed.split_once('=') {
        Some((key, value)) if !key.trim().is_empty() => Ok(Line::Pair {
            key: key.trim().to_string(),
            value: value.trim().to_string(),
        }),
        _ => Err(ParseError {
            line: number,
            message: format!("expected key=value, found {:?}", trimmed),
        }),
    }
}

pub fn parse(text: &str) -> Result<HashMap<String, String>, ParseError> {
    let mut pairs = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        if let Line::Pair { key, value } = parse_line(index + 1, line)? {
            pairs.insert(key, value);
        }
    }
    Ok(pairs)
}
